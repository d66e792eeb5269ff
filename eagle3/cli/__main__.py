"""``python -m eagle3.cli``."""

from eagle3.cli import main

if __name__ == "__main__":
    main()
