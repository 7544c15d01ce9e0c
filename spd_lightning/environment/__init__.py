"""What SPD-Lightning needs of the installed software: the lowest supported releases (`versions.py`)."""
