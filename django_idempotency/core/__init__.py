"""The framework-free core: the request state machine and the types every layer shares.

Nothing here imports Django, a database driver or any other module of this package.
"""

__all__: list[str] = []
