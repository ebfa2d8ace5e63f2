"""Small pieces every part shares: the error types the CLI maps to exit codes and the
progress-callback protocol. Standard library only, so `sizing/` may import it."""
