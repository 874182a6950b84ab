"""The HTTP side of the gateway: the app factory, routes, middleware, SSE, schemas, connections, and the one
mapping from errors to status codes and JSON bodies (errors.py). The only code that knows HTTP."""
