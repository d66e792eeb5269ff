"""``python -m eagle3``: the same command line as the ``eagle3`` console script."""

from eagle3.cli import main

if __name__ == "__main__":
    main()
