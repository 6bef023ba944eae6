"""The same-host machinery, private to the user running it: the host lock that serializes
SQLite writers (`hostlock`), the shared fdatasync of group commit (`groupsync`), wake-up
sockets (`wakeup`), the hub process that routes them (`hub`) and the batched runners' claim
files (`claimfile`). Nothing here decides a rule; it makes the rules cheap on one host."""
