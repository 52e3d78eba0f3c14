"""HTTP plumbing under every route: the one body reader, the error boundary, the request-head limit of the uvicorn
protocol, and the chat lane past Starlette's router. Imports nothing above the server's errors and metrics."""
