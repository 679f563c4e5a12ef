"""The HTTP layer: the Tinker REST/protobuf API (FastAPI), request validation and the CLI.

`tx.api.app.create_app(settings, db, models)` builds the app; `python -m tx.api` runs the whole
server (database, engine thread, HTTP). Routes validate and queue; they never touch the model.
"""
