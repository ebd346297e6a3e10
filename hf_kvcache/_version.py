"""The package's release (pyproject.toml's version), in a module of its own: the modules that record it (saved caches,
the harness's results) read it without importing the package's top."""

__version__ = "0.1.0"
