"""The run state machine's statements, one catalogue per database: `postgresql`, `sqlite`,
`mysql` (MariaDB too), each naming the same statements (`claim`, `SUCCESS`, `flow_claim`,
`BACKLOG`, `INSERT_QUEUE`) besides its OWN; `shared` holds what they are written with.
`runs/sql.py` binds and runs them."""
