"""The wire contract, kind by kind (issue 13): each test is named after a kind of fault other
gateways had."""
