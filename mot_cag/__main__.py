from mot_cag.cli import main

main()
