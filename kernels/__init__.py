"""Hot-path operators. Each module holds the torch reference of one operator; the Triton versions
(tested against these references) join them, behind one dispatch point."""
