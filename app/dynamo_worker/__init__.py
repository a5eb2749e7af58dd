"""Pensieve as an NVIDIA Dynamo worker (docs/dynamo.md): `python -m app.dynamo_worker`.

Its own home: nothing else in the app imports it, and it needs `ai-dynamo` installed."""
