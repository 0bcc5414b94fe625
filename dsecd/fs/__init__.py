"""dsecd.fs: see docs and DESIGN.md."""
