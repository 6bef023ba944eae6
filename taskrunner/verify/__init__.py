"""``taskrunner verify``: the guarantees checked against a user's own database and
deployment. A mixed workload (`workload`) runs on a queue of its own in real runner
processes while faults are injected (`faults`); every enqueue, start, step, side effect and
end is recorded in a history (`history`), and a checker that reads only the history
(`checker`) says, per property, whether the design's rules held. `session` runs it all."""
