"""One module per resource: ``completions``, ``chat``, ``models`` (with ``/health``)."""
