"""`python -m inference.serve` (docs/SERVING.md): the command line (`server.py`), the OpenAI-compatible app
(`app.py`), the FIFO and its worker (`engine.py`), the persistent ranks (`ranks.py`), metrics and shutdown."""
