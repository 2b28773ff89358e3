"""mykv: an example engine checked with pytest-kvcompile (examples/downstream/README.md)."""
