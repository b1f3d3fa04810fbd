"""Exactly-once effects for Django and Django REST framework."""

__version__ = "0.1.0"

__all__ = ["__version__"]
