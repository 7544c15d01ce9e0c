"""One decode, the same on every rank and in the simulator: the schedule (`schedule.py`), verification
(`verify.py`), the fixed-shape messages (`messages.py`), the transports (`transport.py`, `shared_transport.py`), the
runner that executes a cycle over B slots, batch 1 included (`pipeline.py`; its message traffic `traffic.py`, its
verdict channel `verdicts.py`, a joining slot's prefill `prefill.py`, one sequence per slot `slots.py`), the
single-process simulator and the AR reference (`simulator.py`, `ar.py`), the result and the timing switch
(`result.py`, `profiler.py`).
docs/DESIGN.md, "The decoder"."""
