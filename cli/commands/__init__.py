"""One module per subcommand; each exposes `register(app)` and imports only typer at
import time (heavy libraries are imported inside the command function)."""
