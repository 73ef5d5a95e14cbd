"""`leapfrog serve`: the HTTP server (app.py) and what it stands on: configuration, authentication,
the engine thread, metrics, and the OpenAI protocol."""
