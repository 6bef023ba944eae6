"""Who is alive and who leads, across processes and hosts: runner registration, heartbeats
and dead runners (`liveness`, rules 5 and 7), the maintenance lease (`leadership`) and the
fleet's maintenance pass that its holder runs (`maintenance`)."""
