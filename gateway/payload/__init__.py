"""Request bodies: the walk over every part of a JSON body (`walk`), the tables it
applies (`rules`), and the inspector that resolves the media it found (`inspector`)."""
