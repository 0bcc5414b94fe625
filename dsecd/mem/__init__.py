"""dsecd.mem: see docs and DESIGN.md."""
