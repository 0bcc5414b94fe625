"""dsecd.cpu: see docs and DESIGN.md."""
