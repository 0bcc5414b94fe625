"""`python -m dsecd.cli ARGV`: dsec, as the `dsec` script runs it."""

from .dispatch import main

if __name__ == "__main__":
    main()
