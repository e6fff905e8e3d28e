from shared.schemas import write_all

for path in write_all():
    print(path)
