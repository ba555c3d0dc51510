"""``python -m dlstore ...`` runs the command line (also under ``torchrun -m dlstore ...``)."""

from .cli import main

if __name__ == "__main__":
    main()
