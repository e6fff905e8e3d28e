"""The admission→placement pipeline: not a service of its own, the decision rules between two (see core/)."""
