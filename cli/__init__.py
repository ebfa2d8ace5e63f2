"""The typer app: one module per subcommand under `commands/`; all printing lives here."""
