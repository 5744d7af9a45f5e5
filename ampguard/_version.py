"""The package version, in a module of its own: nothing needs to import the package root for it."""

__version__ = "0.1.0"
