"""``python -m rlhf`` is the ``rlhf`` command."""

from rlhf.cli.main import main

if __name__ == "__main__":
    main()
