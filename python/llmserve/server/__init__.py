"""The HTTP shell: a Starlette app factory with thin routes that pass bytes through."""
