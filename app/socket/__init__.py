"""The chat socket: its connection (`chat.py`), its client frames (`frames.py`), and a turn
that outlives the socket that started it (`live.py`)."""
