"""The ``taskrunner`` command: the parser and dispatch (`main`), shared argument handling
(`args`) and the commands grouped by what they act on (`runs`, `periodic`, `queues`,
`calendar`)."""
