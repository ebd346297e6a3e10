"""Tools over the package (the GPU run): importable and typed like the package, never imported by its core."""
