"""What to run, as the user wrote it: the matrix (`matrix`), a tune's search block (`search_spec`), token counts."""
