"""The microVM backend: one QEMU guest per sandbox (docs/architecture.md)."""
