"""Development tools for disagg-operator; nothing here ships in the operator or serving image."""
