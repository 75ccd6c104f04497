"""``python -m copytrace ...`` is the ``copytrace`` command."""

from copytrace.cli import console_main

if __name__ == "__main__":
    console_main()
