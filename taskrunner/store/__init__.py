"""One bound database: URLs and drivers (`db`), the bound `Store` with its transactions and
retries (`bound`), the tables (`models`) and their numbered `migrations`, and how an outage is
ridden out (`outage`)."""
