"""dsecd.net: see docs and DESIGN.md."""
