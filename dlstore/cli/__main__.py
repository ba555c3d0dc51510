"""``python -m dlstore.cli ...``, as the ``dlstore`` console script."""

from . import main

if __name__ == "__main__":
    main()
