"""``python -m mot_cag.cli``."""

from mot_cag.cli import main

main()
