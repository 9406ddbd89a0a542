"""``qkov explore``: a local web server over one model, each view computed on demand by the library."""

__all__: list[str] = []

