"""The n + 1 rank processes: the job they run (`job.py`), the elastic launcher (`launch.py`), what each rank loads
(`roles.py`), several nodes (`nodes.py`), the reports that name a failing rank (`reports.py`), and test-only fault
injection (`faults.py`)."""
