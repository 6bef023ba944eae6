"""The runner process: its loop (`process`), its heartbeat thread (`heartbeat`), batched
claims (`batches`) and how a handler's outcome becomes a run's end (`outcomes`)."""
