"""dsecd.backends: see docs and DESIGN.md."""
