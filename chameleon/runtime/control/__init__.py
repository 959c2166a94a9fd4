"""The controller: a pure core (events in, effects out), its ledger and detector, the recorder, and the edge."""
