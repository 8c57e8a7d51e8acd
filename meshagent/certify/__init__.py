"""Certification: does a model split into stages give the whole model's answers, per wire
dtype? Checks, reports and the signed capability record."""
