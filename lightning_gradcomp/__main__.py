from lightning_gradcomp.cli import main

main()
