"""The runner process: its loop (`loop`: `Runner`), waiting for work (`idle`), the execution
of one run (`execute`), its heartbeat thread (`heartbeat`), batched claims (`batches`) and how
a handler's outcome becomes a run's end (`outcomes`)."""
