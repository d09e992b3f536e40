"""The one append-only audit log of privileged and money-moving actions (see ``services``)."""
