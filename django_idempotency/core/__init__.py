"""The framework-free core: the request state machine, the lease rule and the types every
layer shares.

Nothing here imports a database driver, a request or any other module of this package;
``leases.py`` alone imports Django's query expressions, for the lease rule's ORM form.
"""

__all__: list[str] = []
