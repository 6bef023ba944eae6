"""The run lifecycle, rules 1-4: adding tasks (`enqueue`), creating, claiming and ending runs
(`lifecycle`), cancel and retry (`control`), concurrency keys (`concurrency`), named queues
(`queues`) and rotation (`rotation`)."""
